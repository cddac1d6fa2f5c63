"""verifiers' container runtimes (`podman`, `docker`) on this machine: the default image, built here from Debian's
packages and PyPI's wheels with no container registry (`image`), and what the engine needs (`engine`)."""
