class CheckpointError(ValueError):
    """A checkpoint folder, file or tensor that cannot be loaded; the message names the file and the tensor."""
