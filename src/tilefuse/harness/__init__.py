"""Timing, ceilings, error statistics and the report writer; reads only the registry."""
