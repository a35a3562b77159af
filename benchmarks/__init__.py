"""pagedserve benchmarks: the same workload and KV budget through pagedserve and Hugging Face baselines."""
