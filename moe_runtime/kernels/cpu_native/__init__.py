"""The CPU kernels compiled from C++ on first use (expert_mlp.cpp, weight_dots.h), and their torch operators."""
