# Sourced by the GPU machine's Wan-step scripts after gpu_env.sh: diffusers (and, when its
# import needs it, huggingface_hub) from the wheels carried in .whl_wan into /tmp/wan, when the
# image has none.
if ! python3 -c "import diffusers" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/wan .whl_wan/diffusers-*.whl
    export PYTHONPATH=/tmp/wan:$PYTHONPATH
    if ! python3 -c "import diffusers.models" 2>/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/wan .whl_wan/huggingface_hub-*.whl
    fi
fi
