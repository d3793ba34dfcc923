"""code-executor: untrusted programs run under bubblewrap behind SandboxFusion's /run_code API."""
