"""What the torch modules (tierstore.nn, .torchrec, .distributed) share: the bag math, checkpoints and their optimizer state, FBGEMM's kernels, sharding plans."""
