"""Configuration: one declaration per key; the file loader, the flags and the reload rules."""
