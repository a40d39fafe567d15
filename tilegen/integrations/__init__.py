"""Calling conventions and pipelines of the frameworks users run, on tilegen's op
(`tilegen.integrations.fastvideo`: FastVideo's calls; `tilegen.integrations.diffusers`:
diffusers' Wan transformer with block-sparse self-attention and per-layer calibration;
`tilegen.integrations.parallel`: sequence-parallel (Ulysses) attention on torch.distributed;
`tilegen.integrations.attention`: the block-sparse self-attention of those two)."""
