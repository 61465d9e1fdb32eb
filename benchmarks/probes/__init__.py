"""One-off measurements of single mechanisms: kernel anatomies, launch-setting sweeps, transfer
and NCCL probes. They may reach into internal APIs and are not part of `tandem.bench`, which
holds only the load generator and the benchmarks the README documents. Results that matter go
on bench/RESULTS.md with the command that produced them."""
