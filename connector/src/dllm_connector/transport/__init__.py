"""KV transports: one interface (base.Transport), Mooncake and torch.distributed implementations, the
side channel, staging buffers, and which data path a transfer takes (placement).

Nothing is imported here, so that the pure modules (placement) load without torch; import each module
by its own name.
"""
