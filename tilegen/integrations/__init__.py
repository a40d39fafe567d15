"""Calling conventions of the frameworks users run, on tilegen's op
(`tilegen.integrations.fastvideo`)."""
