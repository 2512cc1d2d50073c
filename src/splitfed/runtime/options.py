"""Constants of the run options that the command-line parser needs without importing
torch (so that a bad option is answered at once)."""

#: fewest characters of a secret given by the user (``SPLITFED_SECRET``, ``--secret-file``)
MIN_SECRET = 32
