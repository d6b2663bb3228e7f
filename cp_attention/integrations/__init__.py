"""Optional integrations with serving engines. Nothing here is imported by the core package."""
