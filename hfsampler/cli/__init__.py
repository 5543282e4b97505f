"""The command line: an explicit table of commands, their flags and the calls they make."""
