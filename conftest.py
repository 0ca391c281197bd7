"""Session-wide test settings: keep Ray on loopback and quiet."""

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DISABLE_DOCKER_CPU_WARNING", "1")
