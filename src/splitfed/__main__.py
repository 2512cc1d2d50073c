from splitfed.cli import entry

entry()
