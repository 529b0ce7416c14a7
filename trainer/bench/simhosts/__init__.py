"""Simulated hosts on one Linux machine (network namespaces, link rates,
CPU budgets), the benchmark's runs on them and the ps-link bound. Used by
the benchmark and the tests; nothing in training imports it."""
