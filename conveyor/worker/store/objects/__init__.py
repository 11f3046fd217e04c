"""Object storage: the interface (``base``), its backends (``local``, ``s3``) and ``factory``."""
