"""Hard limits on what a run may ask for, shared by the config checks and the model
builders (no imports: the command line answers a bad value before torch loads)."""

#: parameters of a model (8 GB of float32; OPT-1.3B has 1.32e9): checked before it is
#: built, as is the memory of the machine (splitfed.config.check_model_size)
MAX_MODEL_PARAMS = 2 * 10**9
