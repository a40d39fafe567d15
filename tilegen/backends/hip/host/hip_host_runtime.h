// hip_host_runtime.h: run tilegen's rendered gfx942 HIP source on the CPU, as host C++.
//
// The kernel text is compiled unchanged (`tilegen.backends.hip.plan.render_hip`, the same render
// and the same library headers, -I templates/hip/include, that `tilegen build --target gfx942`
// hands to clang's AMDGPU backend); this header comes first and supplies what the device build
// gets from the hardware:
//
//   * TG_KERNEL / TG_DEVICE / TG_SHARED, which the prelude (tilegen/hip/prelude.hpp) only
//     defines when they are undefined;
//   * the launch model: a grid of workgroups, run one after another; each workgroup is
//     THREADS work-items in waves of 64 lanes; every lane is a fiber (its own stack and
//     registers) and a scheduler decides who runs;
//   * LDS: TG_SHARED makes `smem` a static array in the section "tg_lds" (one workgroup runs at a
//     time, so one copy is enough); it is filled with a poison byte before every workgroup, so
//     a read of LDS nobody wrote this workgroup reads NaN (0xff.. is NaN in bf16, fp16 and fp32);
//   * every __builtin_amdgcn_* the library calls (grep templates/hip for `__builtin_amdgcn`):
//       workitem_id_x, workgroup_id_x/y, mbcnt_lo/hi (V_MBCNT_*_U32_B32: popcount of the mask
//       bits below the lane), readfirstlane, ds_bpermute, s_barrier, fence, s_waitcnt (no-op),
//       and the four MFMAs mfma_f32_{32x32x8,16x16x16}{bf16_1k,f16}.
//
// Execution model. Lanes run one at a time up to their next synchronisation point and then
// hand control back to the scheduler (a fiber switch):
//   * a cross-lane op (readfirstlane, ds_bpermute, MFMA) is a wave-wide rendezvous: each lane
//     deposits its operands and parks; once every lane of the wave has parked at the same op,
//     the scheduler executes it for the whole wave (the lockstep semantics: every lane's
//     operands are read before any lane sees a result) and the lanes resume with their results;
//   * s_barrier parks the lane until every wave of the workgroup that has not exited is at the
//     barrier. Lanes of a wave that disagree (some at a barrier, some at a cross-lane op, some
//     exited; or two different cross-lane ops) are reported as divergence, not guessed at.
// Between barriers the scheduler runs one whole wave to its next barrier before it starts the
// next one, in an order set per launch (waves ascending, descending, or alternating per barrier
// phase). That is the most adversarial interleaving for a missing barrier: a wave that reads
// LDS another wave should have written first reads poison or the previous tile, and a wave that
// overwrites LDS before another wave read it changes what that wave reads. Running two orders
// and comparing the outputs bit for bit (executor.py does) turns any LDS race into an error.
// Lanes of one wave run one after another between two cross-lane ops, so the executor is
// stricter than hardware for LDS traffic inside one wave (real lanes run in lockstep); the
// kernel never communicates through LDS within a wave without a barrier.
//
// The host compiler must not move LDS loads and stores across a barrier: block_sync() in the
// prelude wraps s_barrier in two __builtin_amdgcn_fence calls, which compile here to real
// atomic fences, and LLVM treats a fence as reading and writing all memory (the ordering the
// device build relies on too).
//
// MFMA semantics. The lane layouts are the equations of AMD's Matrix Instruction Calculator
// (github.com/ROCm/amd_matrix_instruction_calculator, matrix_calculator.py, the gfx9 / CDNA
// class: _coord_to_lane_eqn, _coord_to_input_reg_eqn and _coord_to_output_reg_eqn, which
// `--detail-instruction` prints as "Matrix element to register mapping with no modifiers"),
// for the CDNA2 entries v_mfma_f32_32x32x8bf16_1k, v_mfma_f32_16x16x16bf16_1k,
// v_mfma_f32_32x32x8f16 and v_mfma_f32_16x16x16f16 (blocks = 1; CBSZ, ABID, BLGP = 0). gfx942
// (CDNA3) keeps these instructions; its ISA guide spells the bf16 ones v_mfma_f32_32x32x8_bf16
// and v_mfma_f32_16x16x16_bf16 (as LLVM's gfx940 assembler prints the *_1k mnemonics):
//
//   v_mfma_f32_32x32x8{bf16_1k,f16}  (M = N = 32, K = 8; A, B: 2 VGPRs, C/D: 16 VGPRs)
//     A[i][k]  lane = 32 * floor(k / 4) + i    VGPR floor(k / 2) % 2, bits 16*(k%2) .. 16*(k%2)+15
//     B[k][j]  lane = 32 * floor(k / 4) + j    same VGPR / bits as A
//     D[i][j]  lane = (32 * floor(i / 4)) % 64 + j    VGPR 4 * floor(i / 8) + (i % 4)
//   v_mfma_f32_16x16x16{bf16_1k,f16} (M = N = 16, K = 16; A, B: 2 VGPRs, C/D: 4 VGPRs)
//     A[i][k]  lane = 16 * floor(k / 4) + i    VGPR floor(k / 2) % 2, bits 16*(k%2) .. 16*(k%2)+15
//     B[k][j]  lane = 16 * floor(k / 4) + j    same VGPR / bits as A
//     D[i][j]  lane = 16 * floor(i / 4) + j    VGPR (i % 4)
//
// The two 32-bit VGPRs of an A/B operand are the 4-element 16-bit vector the builtin takes
// (short4 for bf16, half4 for f16), element 2 * VGPR + half = k % 4; C/D VGPR r is element r of
// the float vector. These maps are written here from the calculator's equations, not from
// tilegen's own plan (HipPlan.acc_row and friends), so the executor is an independent check of
// the template's lane arithmetic.
//
// Arithmetic: 16-bit inputs are raw bit patterns, widened exactly (bf16: bits << 16; fp16: IEEE
// half). Every product is exact in double; D[i][j] = C[i][j] + sum over k is summed in double
// in k order and rounded once to fp32. (The hardware's internal summation order is not
// documented; this is the exact-products, single-rounding model, which may differ from a
// sequential fp32 sum in the last bits.) The rest of the kernel's
// arithmetic is the host's IEEE fp32 (no FMA contraction); __builtin_exp2f / __builtin_log2f
// are the host libm's, where the device uses v_exp_f32 / v_log_f32 (about 1 ulp): the last bits
// of a result may differ from an MI300's, nothing more.

#pragma once

#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <sys/mman.h>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

// ---- what hip_runtime.h would provide (the prelude defines them only when undefined) ---------
#define TG_KERNEL extern "C"
#define TG_DEVICE inline
#define TG_SHARED static __attribute__((section("tg_lds")))
// clang accepts amdgpu_flat_work_group_size only on kernel (__global__ / OpenCL) functions,
// which host C++ has none of: inside the kernel's __attribute__((...)) it becomes a harmless
// annotation. (executor.py checks the launch's block against the numbers in the source.)
#define amdgpu_flat_work_group_size(lo, hi) annotate("amdgpu_flat_work_group_size")

extern "C" char __start_tg_lds[] __attribute__((weak, visibility("hidden")));
extern "C" char __stop_tg_lds[] __attribute__((weak, visibility("hidden")));

// The launch request and its report: filled by the caller (executor.py mirrors it in ctypes).
extern "C" struct tg_host_launch {
  unsigned grid[3];           // workgroups in x, y, z
  unsigned block[3];          // work-items per workgroup: (THREADS, 1, 1)
  int schedule;               // 0: waves ascending, 1: descending, 2: alternating per phase
  int lds_poison;             // byte written over LDS before each workgroup; < 0: leave it
  unsigned long long lds_bytes;      // out: size of the "tg_lds" section (the kernel's LDS)
  unsigned long long workgroups;     // out: workgroups run
  unsigned long long barriers;       // out: workgroup barriers completed (all workgroups)
  unsigned long long mfma;           // out: wave-level MFMA instructions executed
  unsigned long long bpermute;       // out: wave-level ds_bpermute executed
  unsigned long long readfirstlane;  // out: wave-level readfirstlane executed
  char error[1024];                  // out: empty, or why the launch failed
};

namespace tg_host {

typedef short i16x4 __attribute__((ext_vector_type(4)));
typedef _Float16 f16x4 __attribute__((ext_vector_type(4)));
typedef float f32x4 __attribute__((ext_vector_type(4)));
typedef float f32x16 __attribute__((ext_vector_type(16)));

constexpr int kWave = 64;
constexpr size_t kStackBytes = 256 * 1024;  // per lane; plus one guard page below each stack

enum class State : int { Ready, WaveOp, Barrier, Done, Failed };
enum Op : int { kNoOp, kReadFirstLane, kBpermute, kMfma };

// MFMA kinds: the tag a wave's lanes must agree on.
enum MfmaKind : int { k32x32x8bf16 = 1, k16x16x16bf16, k32x32x8f16, k16x16x16f16 };

struct Lane {
  void* sp = nullptr;  // saved stack pointer while parked (x86-64 switch)
#if !defined(__x86_64__)
  ucontext_t ctx;
#endif
  unsigned tid = 0;  // workitem_id_x
  State state = State::Ready;
  int op = kNoOp;
  int tag = 0;
  uint32_t in0 = 0, in1 = 0;
  uint64_t a = 0, b = 0;  // MFMA A and B operands: four 16-bit values each
  float c[16] = {};
  float d[16] = {};
  uint32_t out = 0;
};

struct Body {
  void (*fn)(void*);
  void* ctx;
};

struct Group {
  Lane* lanes = nullptr;
  int threads = 0;
  int waves = 0;
  char* stacks = nullptr;
  size_t stack_stride = 0;
  void* sched_sp = nullptr;
#if !defined(__x86_64__)
  ucontext_t sched_ctx;
#endif
  Body body{};
  tg_host_launch* launch = nullptr;
  bool failed = false;
};

static Group* g_group = nullptr;
static Lane* g_lane = nullptr;
static unsigned g_workgroup[3] = {0, 0, 0};

static void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
static void fail(const char* fmt, ...) {
  Group* g = g_group;
  if (g == nullptr || g->failed) return;
  g->failed = true;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g->launch->error, sizeof(g->launch->error), fmt, ap);
  va_end(ap);
}

// ---- fibers ----------------------------------------------------------------------------------
#if defined(__x86_64__)
// Save the callee-saved registers, MXCSR and the x87 control word on the current stack, store
// the stack pointer in *save, switch to `load` and pop the same frame from there.
extern "C" void tg_host_switch(void** save, void* load);
extern "C" void tg_host_fiber_start();
__asm__(
    ".text\n"
    ".p2align 4\n"
    ".globl tg_host_switch\n"
    ".hidden tg_host_switch\n"
    ".type tg_host_switch,@function\n"
    "tg_host_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  subq $8, %rsp\n  stmxcsr (%rsp)\n  fnstcw 4(%rsp)\n"
    "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
    "  ldmxcsr (%rsp)\n  fldcw 4(%rsp)\n  addq $8, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    ".size tg_host_switch, .-tg_host_switch\n"
    ".p2align 4\n"
    ".globl tg_host_fiber_start\n"
    ".hidden tg_host_fiber_start\n"
    ".type tg_host_fiber_start,@function\n"
    "tg_host_fiber_start:\n"  // first switch into a lane lands here: r12 = Lane*, rbx = entry
    "  movq %r12, %rdi\n  callq *%rbx\n  ud2\n"
    ".size tg_host_fiber_start, .-tg_host_fiber_start\n");
#endif

static void lane_main(Lane* lane);

#if !defined(__x86_64__)
static void lane_trampoline(unsigned hi, unsigned lo) {
  lane_main(reinterpret_cast<Lane*>((static_cast<uintptr_t>(hi) << 32) | lo));
}
#endif

static void init_fiber(Group& g, Lane& lane, int index) {
  char* base = g.stacks + static_cast<size_t>(index) * g.stack_stride;
  char* top = base + g.stack_stride;  // the guard page is at `base`
#if defined(__x86_64__)
  uint64_t* sp = reinterpret_cast<uint64_t*>(top) - 10;  // 16-byte aligned
  sp[0] = 0x037F00001F80ull;                             // MXCSR default, x87 control word
  sp[1] = 0;                                             // r15
  sp[2] = 0;                                             // r14
  sp[3] = 0;                                             // r13
  sp[4] = reinterpret_cast<uint64_t>(&lane);             // r12
  sp[5] = reinterpret_cast<uint64_t>(&lane_main);        // rbx
  sp[6] = 0;                                             // rbp
  sp[7] = reinterpret_cast<uint64_t>(&tg_host_fiber_start);
  lane.sp = sp;
#else
  getcontext(&lane.ctx);
  lane.ctx.uc_stack.ss_sp = base + 4096;
  lane.ctx.uc_stack.ss_size = g.stack_stride - 4096;
  lane.ctx.uc_link = nullptr;
  const uintptr_t p = reinterpret_cast<uintptr_t>(&lane);
  makecontext(&lane.ctx, reinterpret_cast<void (*)()>(&lane_trampoline), 2,
              static_cast<unsigned>(p >> 32), static_cast<unsigned>(p & 0xffffffffu));
#endif
}

// Lane side: park in `state` and give control back to the scheduler.
static void park(State state) {
  Lane* lane = g_lane;
  lane->state = state;
#if defined(__x86_64__)
  tg_host_switch(&lane->sp, g_group->sched_sp);
#else
  swapcontext(&lane->ctx, &g_group->sched_ctx);
#endif
}

// Scheduler side: run `lane` until it parks again.
static void resume(Group& g, Lane& lane) {
  g_lane = &lane;
#if defined(__x86_64__)
  tg_host_switch(&g.sched_sp, lane.sp);
#else
  swapcontext(&g.sched_ctx, &lane.ctx);
#endif
  g_lane = nullptr;
}

static void lane_main(Lane* lane) {
  g_group->body.fn(g_group->body.ctx);
  lane->state = State::Done;
  for (;;) park(State::Done);
}

static Lane& current_lane() { return *g_lane; }
static int lane_in_wave() { return static_cast<int>(current_lane().tid % kWave); }

// ---- MFMA --------------------------------------------------------------------------------------
static inline double widen(uint16_t bits, bool bf16) {
  if (bf16) {
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  _Float16 h;
  std::memcpy(&h, &bits, 2);
  return static_cast<double>(static_cast<float>(h));
}

static inline uint16_t operand(uint64_t frag, int element) {
  return static_cast<uint16_t>(frag >> (16 * element));
}

// D = A B + C for one wave, with the calculator's lane layouts (see the header comment).
static void exec_mfma(Group& g, int first, int tag) {
  const bool bf16 = tag == k32x32x8bf16 || tag == k16x16x16bf16;
  const int mn = (tag == k32x32x8bf16 || tag == k32x32x8f16) ? 32 : 16;
  const int kk = mn == 32 ? 8 : 16;
  Lane* w = &g.lanes[first];
  double A[32][16], B[16][32];
  for (int i = 0; i < mn; ++i)
    for (int k = 0; k < kk; ++k) {
      const int lane = mn * (k / 4) + i;  // A[i][k]: lane mn*floor(k/4)+i, element k%4
      A[i][k] = widen(operand(w[lane].a, k % 4), bf16);
    }
  for (int k = 0; k < kk; ++k)
    for (int j = 0; j < mn; ++j) {
      const int lane = mn * (k / 4) + j;  // B[k][j]: lane mn*floor(k/4)+j, element k%4
      B[k][j] = widen(operand(w[lane].b, k % 4), bf16);
    }
  for (int i = 0; i < mn; ++i)
    for (int j = 0; j < mn; ++j) {
      int lane, reg;
      if (mn == 32) {
        lane = (32 * (i / 4)) % 64 + j;
        reg = 4 * (i / 8) + (i % 4);
      } else {
        lane = 16 * (i / 4) + j;
        reg = i % 4;
      }
      double acc = w[lane].c[reg];
      for (int k = 0; k < kk; ++k) acc += A[i][k] * B[k][j];
      w[lane].d[reg] = static_cast<float>(acc);
    }
}

static void exec_wave_op(Group& g, int wave) {
  const int first = wave * kWave;
  Lane* w = &g.lanes[first];
  const int op = w[0].op;
  for (int l = 1; l < kWave; ++l)
    if (w[l].op != op || w[l].tag != w[0].tag) {
      fail("wave %d of workgroup (%u, %u, %u): lanes 0 and %d are at different cross-lane ops "
           "(%d/%d vs %d/%d)", wave, g_workgroup[0], g_workgroup[1], g_workgroup[2], l, op,
           w[0].tag, w[l].op, w[l].tag);
      return;
    }
  switch (op) {
    case kReadFirstLane:  // every lane of the wave is active: the first active lane is lane 0
      for (int l = 0; l < kWave; ++l) w[l].out = w[0].in0;
      g.launch->readfirstlane++;
      break;
    case kBpermute: {  // ds_bpermute_b32: lane l gets data of lane (addr[l] / 4) mod 64
      uint32_t data[kWave];
      for (int l = 0; l < kWave; ++l) data[l] = w[l].in1;
      for (int l = 0; l < kWave; ++l) w[l].out = data[(w[l].in0 >> 2) & (kWave - 1)];
      g.launch->bpermute++;
      break;
    }
    case kMfma:
      exec_mfma(g, first, w[0].tag);
      g.launch->mfma++;
      break;
    default:
      fail("unknown cross-lane op %d", op);
  }
}

// Run one wave until all its lanes are at a barrier or done; false on an error.
static bool run_wave(Group& g, int wave, bool descending) {
  const int first = wave * kWave;
  for (;;) {
    for (int n = 0; n < kWave; ++n) {
      Lane& lane = g.lanes[first + (descending ? kWave - 1 - n : n)];
      if (lane.state == State::Ready) resume(g, lane);
      if (lane.state == State::Failed || g.failed) return false;
    }
    int at_op = 0, at_barrier = 0, done = 0;
    for (int l = 0; l < kWave; ++l) {
      const State s = g.lanes[first + l].state;
      at_op += s == State::WaveOp;
      at_barrier += s == State::Barrier;
      done += s == State::Done;
    }
    if (at_op == kWave) {
      exec_wave_op(g, wave);
      if (g.failed) return false;
      for (int l = 0; l < kWave; ++l) g.lanes[first + l].state = State::Ready;
      continue;
    }
    if (at_barrier == kWave || done == kWave) return true;
    fail("wave %d of workgroup (%u, %u, %u) diverged: %d lanes at a cross-lane op, %d at a "
         "barrier, %d exited", wave, g_workgroup[0], g_workgroup[1], g_workgroup[2], at_op,
         at_barrier, done);
    return false;
  }
}

static bool run_workgroup(Group& g) {
  for (int t = 0; t < g.threads; ++t) {
    Lane& lane = g.lanes[t];
    lane = Lane{};
    lane.tid = static_cast<unsigned>(t);
    init_fiber(g, lane, t);
  }
  const size_t lds = static_cast<size_t>(__stop_tg_lds - __start_tg_lds);
  if (g.launch->lds_poison >= 0 && lds > 0)
    std::memset(__start_tg_lds, g.launch->lds_poison, lds);
  for (int phase = 0;; ++phase) {
    const int sched = g.launch->schedule;
    const bool descending = sched == 1 || (sched == 2 && (phase & 1));
    for (int n = 0; n < g.waves; ++n)
      if (!run_wave(g, descending ? g.waves - 1 - n : n, descending)) return false;
    int done_waves = 0;
    for (int w = 0; w < g.waves; ++w) done_waves += g.lanes[w * kWave].state == State::Done;
    if (done_waves == g.waves) return true;
    // Every wave that has not exited is at the barrier: release it.
    for (int t = 0; t < g.threads; ++t)
      if (g.lanes[t].state == State::Barrier) g.lanes[t].state = State::Ready;
    g.launch->barriers++;
  }
}

static int run_grid(tg_host_launch* launch, Body body) {
  launch->error[0] = '\0';
  launch->workgroups = launch->barriers = launch->mfma = 0;
  launch->bpermute = launch->readfirstlane = 0;
  launch->lds_bytes = static_cast<unsigned long long>(__stop_tg_lds - __start_tg_lds);
  const unsigned threads = launch->block[0];
  if (threads == 0 || threads % kWave || launch->block[1] != 1 || launch->block[2] != 1) {
    snprintf(launch->error, sizeof(launch->error),
             "block (%u, %u, %u): the executor runs (64 * waves, 1, 1) workgroups",
             launch->block[0], launch->block[1], launch->block[2]);
    return 1;
  }
  if (launch->lds_bytes > 65536) {
    snprintf(launch->error, sizeof(launch->error), "kernel uses %llu B of LDS; gfx942 has 65536",
             launch->lds_bytes);
    return 1;
  }
  Group g;
  g.lanes = new Lane[threads];
  g.threads = static_cast<int>(threads);
  g.waves = static_cast<int>(threads / kWave);
  g.body = body;
  g.launch = launch;
  const size_t page = 4096;
  g.stack_stride = kStackBytes + page;
  const size_t total = g.stack_stride * threads;
  void* mem = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) {
    delete[] g.lanes;
    snprintf(launch->error, sizeof(launch->error), "mmap of %zu bytes of lane stacks failed",
             total);
    return 1;
  }
  g.stacks = static_cast<char*>(mem);
  for (unsigned t = 0; t < threads; ++t)  // a guard page under each stack: overflow faults
    mprotect(g.stacks + t * g.stack_stride, page, PROT_NONE);
  g_group = &g;
  bool ok = true;
  for (unsigned z = 0; ok && z < launch->grid[2]; ++z)
    for (unsigned y = 0; ok && y < launch->grid[1]; ++y)
      for (unsigned x = 0; ok && x < launch->grid[0]; ++x) {
        g_workgroup[0] = x;
        g_workgroup[1] = y;
        g_workgroup[2] = z;
        ok = run_workgroup(g);
        launch->workgroups++;
      }
  g_group = nullptr;
  munmap(mem, total);
  delete[] g.lanes;
  if (!ok && launch->error[0] == '\0')
    snprintf(launch->error, sizeof(launch->error), "launch failed");
  return ok ? 0 : 1;
}

// Unpack a kernarg buffer laid out by the AMDGPU ABI (each argument at the next multiple of its
// own size and alignment, in order; what tilegen.runtime.hip.pack_kernargs writes) into the
// kernel's parameter types, then run the grid with every lane calling the kernel.
template <class... Args>
struct Unpacked;
template <>
struct Unpacked<> {
  size_t read(const unsigned char*, size_t, size_t offset) { return offset; }
  template <class F, class... Done>
  void call(F f, Done... done) const { f(done...); }
};
template <class T, class... Rest>
struct Unpacked<T, Rest...> {
  T value{};
  Unpacked<Rest...> rest;
  size_t read(const unsigned char* buf, size_t size, size_t offset) {
    offset = (offset + alignof(T) - 1) / alignof(T) * alignof(T);
    if (offset + sizeof(T) <= size) std::memcpy(&value, buf + offset, sizeof(T));
    return rest.read(buf, size, offset + sizeof(T));
  }
  template <class F, class... Done>
  void call(F f, Done... done) const { rest.call(f, done..., value); }
};

template <class... Args>
int launch_packed(void (*kernel)(Args...), const unsigned char* kernargs, size_t size,
                  tg_host_launch* launch) {
  struct Ctx {
    void (*kernel)(Args...);
    Unpacked<Args...> args;
  } ctx{kernel, {}};
  const size_t used = ctx.args.read(kernargs, size, 0);
  if (used != size) {
    snprintf(launch->error, sizeof(launch->error),
             "kernarg buffer has %zu bytes; the kernel's %zu parameters take %zu", size,
             sizeof...(Args), used);
    return 1;
  }
  Body body{[](void* p) {
              const Ctx* c = static_cast<const Ctx*>(p);
              c->args.call(c->kernel);
            },
            &ctx};
  return run_grid(launch, body);
}

}  // namespace tg_host

// ---- the builtins, as the kernel calls them ---------------------------------------------------
// clang only knows __builtin_amdgcn_* when it targets AMDGPU; for the host they are ordinary
// functions with the builtins' signatures (clang's BuiltinsAMDGPU.def).
#define TG_HOST_BUILTIN static inline __attribute__((always_inline))

TG_HOST_BUILTIN unsigned __builtin_amdgcn_workitem_id_x() { return tg_host::current_lane().tid; }
TG_HOST_BUILTIN unsigned __builtin_amdgcn_workgroup_id_x() { return tg_host::g_workgroup[0]; }
TG_HOST_BUILTIN unsigned __builtin_amdgcn_workgroup_id_y() { return tg_host::g_workgroup[1]; }
TG_HOST_BUILTIN unsigned __builtin_amdgcn_workgroup_id_z() { return tg_host::g_workgroup[2]; }

// V_MBCNT_LO_U32_B32 / V_MBCNT_HI_U32_B32: ThreadMask = (1 << lane) - 1 (64 bits);
// lo: src + popcount(mask & ThreadMask[31:0]), hi: src + popcount(mask & ThreadMask[63:32]).
TG_HOST_BUILTIN unsigned __builtin_amdgcn_mbcnt_lo(unsigned mask, unsigned src) {
  const int lane = tg_host::lane_in_wave();
  const unsigned below = lane >= 32 ? 0xffffffffu : ((1u << lane) - 1u);
  return src + static_cast<unsigned>(__builtin_popcount(mask & below));
}
TG_HOST_BUILTIN unsigned __builtin_amdgcn_mbcnt_hi(unsigned mask, unsigned src) {
  const int lane = tg_host::lane_in_wave();
  const unsigned below = lane < 32 ? 0u : ((1u << (lane - 32)) - 1u);
  return src + static_cast<unsigned>(__builtin_popcount(mask & below));
}

TG_HOST_BUILTIN int __builtin_amdgcn_readfirstlane(int x) {
  tg_host::Lane& lane = tg_host::current_lane();
  lane.op = tg_host::kReadFirstLane;
  lane.tag = 0;
  lane.in0 = static_cast<uint32_t>(x);
  tg_host::park(tg_host::State::WaveOp);
  return static_cast<int>(lane.out);
}

TG_HOST_BUILTIN int __builtin_amdgcn_ds_bpermute(int addr, int data) {
  tg_host::Lane& lane = tg_host::current_lane();
  lane.op = tg_host::kBpermute;
  lane.tag = 0;
  lane.in0 = static_cast<uint32_t>(addr);
  lane.in1 = static_cast<uint32_t>(data);
  tg_host::park(tg_host::State::WaveOp);
  return static_cast<int>(lane.out);
}

TG_HOST_BUILTIN void __builtin_amdgcn_s_barrier() {
  __asm__ __volatile__("" ::: "memory");
  tg_host::park(tg_host::State::Barrier);
  __asm__ __volatile__("" ::: "memory");
}

TG_HOST_BUILTIN void __builtin_amdgcn_fence(int order, const char* scope) {
  static_cast<void>(scope);
  __atomic_thread_fence(order);
}

TG_HOST_BUILTIN void __builtin_amdgcn_s_waitcnt(int) {}  // memory is synchronous here

namespace tg_host {
template <int N, class Frag>
static inline __attribute__((always_inline)) void mfma_park(Frag a, Frag b, const float* c,
                                                            float* d, int tag, int cbsz,
                                                            int abid, int blgp) {
  Lane& lane = current_lane();
  if (cbsz != 0 || abid != 0 || blgp != 0) {
    fail("MFMA with cbsz=%d abid=%d blgp=%d: the executor models only 0, 0, 0", cbsz, abid,
         blgp);
    park(State::Failed);
  }
  static_assert(sizeof(Frag) == 8, "four 16-bit values");
  std::memcpy(&lane.a, &a, 8);
  std::memcpy(&lane.b, &b, 8);
  for (int r = 0; r < N; ++r) lane.c[r] = c[r];
  lane.op = kMfma;
  lane.tag = tag;
  park(State::WaveOp);
  for (int r = 0; r < N; ++r) d[r] = lane.d[r];
}

template <int N, class Acc, class Frag>
static inline __attribute__((always_inline)) Acc mfma(Frag a, Frag b, Acc c, int tag, int cbsz,
                                                      int abid, int blgp) {
  float cin[N], dout[N];
  for (int r = 0; r < N; ++r) cin[r] = c[r];
  mfma_park<N>(a, b, cin, dout, tag, cbsz, abid, blgp);
  Acc d{};
  for (int r = 0; r < N; ++r) d[r] = dout[r];
  return d;
}
}  // namespace tg_host

TG_HOST_BUILTIN tg_host::f32x16 __builtin_amdgcn_mfma_f32_32x32x8bf16_1k(
    tg_host::i16x4 a, tg_host::i16x4 b, tg_host::f32x16 c, int cbsz, int abid, int blgp) {
  return tg_host::mfma<16>(a, b, c, tg_host::k32x32x8bf16, cbsz, abid, blgp);
}
TG_HOST_BUILTIN tg_host::f32x4 __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(
    tg_host::i16x4 a, tg_host::i16x4 b, tg_host::f32x4 c, int cbsz, int abid, int blgp) {
  return tg_host::mfma<4>(a, b, c, tg_host::k16x16x16bf16, cbsz, abid, blgp);
}
TG_HOST_BUILTIN tg_host::f32x16 __builtin_amdgcn_mfma_f32_32x32x8f16(
    tg_host::f16x4 a, tg_host::f16x4 b, tg_host::f32x16 c, int cbsz, int abid, int blgp) {
  return tg_host::mfma<16>(a, b, c, tg_host::k32x32x8f16, cbsz, abid, blgp);
}
TG_HOST_BUILTIN tg_host::f32x4 __builtin_amdgcn_mfma_f32_16x16x16f16(
    tg_host::f16x4 a, tg_host::f16x4 b, tg_host::f32x4 c, int cbsz, int abid, int blgp) {
  return tg_host::mfma<4>(a, b, c, tg_host::k16x16x16f16, cbsz, abid, blgp);
}
