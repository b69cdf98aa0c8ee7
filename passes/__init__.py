import os

# onnxruntime (1.32) records every import in a telemetry database under ~/.cache, and warns on each command where the
# home folder is read-only (a container's): off, unless the user set ORT_DISABLE_TELEMETRY themselves
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
