import sys

from dflash_chat.app import main

sys.exit(main())
