"""The benchmark helpers, importable as `_common` by the scripts in this folder (they live in the
package, `kvrestore.benchmarking`, so that `kvrestore bench` can use them too)."""

from kvrestore.benchmarking import *  # noqa: F403
from kvrestore.benchmarking import __all__  # noqa: F401
