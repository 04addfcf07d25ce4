"""Shared pieces of the torch-gemm-ar benchmarks: process setup, inputs, the measured rows, timing, the formulas
(docs/decisions/0012-benchmark-measures.md), tables and JSON. The scripts in benchmarks/ are thin command lines over
these modules."""
