"""Hard limits on what a run may ask for, shared by the config checks and the model
builders (no imports: the command line answers a bad value before torch loads)."""

#: parameters of a model (8 GB of float32; OPT-1.3B has 1.32e9): checked before it is
#: built, as is the memory of the machine (splitfed.config.check_model_size)
MAX_MODEL_PARAMS = 2 * 10**9

#: samples of a data set, its train and test splits together (EMNIST's largest has
#: 814,255; GLUE's SST-2 68,221): checked on the files' headers before their data is
#: read, so that a few kilobytes of files declaring a hundred million tiny samples
#: cannot make the loader and the partition take tens of gigabytes (each sample costs
#: some tens of bytes of labels and index arrays, whatever its size)
MAX_SAMPLES = 1 << 24
