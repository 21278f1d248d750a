"""When this process started (imported first by the package): the recovery-time breakdown in
summary.json measures a restarted worker's start-up from here."""

import time

STARTED_AT = time.time()
