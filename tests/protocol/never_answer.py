"""A runner module whose import never finishes: the loop binds its socket, then hangs before answering hello."""

import time

time.sleep(3600)
