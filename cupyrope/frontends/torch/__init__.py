"""torch.library custom ops (autograd, torch.compile, CUDA graphs) and DTensor sharding rules."""
