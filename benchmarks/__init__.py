"""GPU probes and engine benchmarks, run from the repository root (`python -m benchmarks.llama8b`); not
installed. The user's serving harness is `mii_async.bench` (`mii-async bench`)."""
