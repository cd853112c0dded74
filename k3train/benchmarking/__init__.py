"""Code the benchmarks, the GPU check and the tests share (the scripts stay in benchmarks/)."""
