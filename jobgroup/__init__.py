"""Launchers: SkyPilot job group YAMLs, docker compose, and the whole group on one machine."""
