"""Shared pieces of the torch-gemm-ar benchmarks: process setup, inputs, the measured rows, timing, the seed's
formulas (design.md §9), tables and JSON. The scripts in benchmarks/ are thin command lines over these modules."""
