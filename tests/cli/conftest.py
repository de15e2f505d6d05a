"""Fixtures shared by the CLI tests: the run-directory fixture of ``test_faults.py`` for every file here."""

from tests.cli.test_faults import finished_run, finished_template, run_root  # noqa: F401
