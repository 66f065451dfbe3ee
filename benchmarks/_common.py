"""The benchmark helpers, importable as `_common` by the scripts in this folder (they live in the
package, `kvrestore.tools.benchmarking`, so that `kvrestore bench` can use them too)."""

from kvrestore.tools.benchmarking import *  # noqa: F403
from kvrestore.tools.benchmarking import __all__  # noqa: F401
