"""The training process's side: the supervisor of its children, the batches it receives, GPU placement, states."""
