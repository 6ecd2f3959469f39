"""Preflight planning: what a layout needs per rank before anything is launched (``zerotune plan``)."""
