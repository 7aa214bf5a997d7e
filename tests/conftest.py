from __future__ import annotations

import faulthandler

faulthandler.enable()
