"""The application layer: the `steadyrl` command line, `steadyrl run` (launcher, supervision,
report), recipes (recipe), experiments and evaluation. It imports the library (`shared`), the
services' settings and the benchmarks; the library and the services never import it."""
