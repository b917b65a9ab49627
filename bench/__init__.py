"""TTFT benchmarks: load generator, transports, RTT emulator, reports."""
