"""Wrappers for training code: DDP, FSDP and its units, and the
torch.distributed process group."""
