"""The smallest configuration file that loads: one tier and one fixed-mode model. The tests of
the configuration add a field or a table to it and read what comes of it."""

MINIMAL = """
[[tiers]]
name = "paid"
[[models]]
name = "m@1"
worker = ["echo"]
"""
