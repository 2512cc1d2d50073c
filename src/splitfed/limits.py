"""Hard limits on what a run may ask for, shared by the config checks and the model
builders (no imports: the command line answers a bad value before torch loads)."""

#: parameters of a model (4 GB of float32): checked before it is built
MAX_MODEL_PARAMS = 10**9
