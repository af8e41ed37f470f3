"""Shared core of the npu-cookbook recipes: device backend, fused ops, weight loader."""
