"""The Monitor: energy, power, throttling and memory of any window of a job's code, from inside."""
