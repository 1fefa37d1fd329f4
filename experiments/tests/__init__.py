"""Tests of the experiments' own logic, by level like the project's tests."""
