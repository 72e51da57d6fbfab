"""`python -m mii_async.bench`: the serving benchmark, as `mii-async bench`."""
from __future__ import annotations

from .serving import main

if __name__ == "__main__":
    raise SystemExit(main())
