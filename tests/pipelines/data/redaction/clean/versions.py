"""Version strings the way packages and build scripts write them."""

import re
import sys

__version__ = '11.0.0.1'
VERSION = "4.2.1.7"
version_info = (4, 2, 1, 7)
RELEASE = '3.1.4.1'
app_ver: str = "1.6.22.8"
PRODUCT_VERSION = ("5.2.3.91",)
SUPPORTED = {"min_version": "2.7.4.0", "max_version": "3.12.0.1"}

BANNER = "IronPython 2.7.4 (2.7.4.0) on .NET 4.0.30319.42000"
PYPY_BANNER = "PyPy 7.3.15 (7.3.15.1) with GCC 12.2.0"
TOOLCHAIN = "built with zlib 1.3.0.1, openssl 1.1.1.2 and sqlite3 3.45.1.0"
NOTES = "v1.2.3.4 fixes the importer; 1.2.3.5 and 1.2.3.6 follow, then 1.2.4.0"


def parse(text):
    """'1.2.3.4' -> (1, 2, 3, 4); dotted to any depth."""
    return tuple(int(p) for p in re.findall(r"\d+", text))


def at_least(minimum="2.0.0.0"):
    return parse(__version__) >= parse(minimum)


if sys.platform == "cli":
    assert at_least("2.7.4.0"), "IronPython 2.7.4.0 or later"
