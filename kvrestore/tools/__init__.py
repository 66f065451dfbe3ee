"""Tools built on the library: the command line, the demo, `kvrestore bench`, plotting."""
