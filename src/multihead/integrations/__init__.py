"""Other libraries' models over the core (each submodule imports its library when it is imported)."""
