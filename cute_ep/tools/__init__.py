"""What the scripts, examples and benchmarks share: argument parsing and messages, the checking scripts'
printing, the benchmark peers and reports.

Not part of the library: nothing in cute_ep outside this package (nor cute_ep.kernels, cute_ep.bootstrap,
cute_ep.validators) imports it; these modules import the library.
"""
