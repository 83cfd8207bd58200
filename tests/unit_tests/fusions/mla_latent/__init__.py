# Copyright (c) 2026, megatron_ext contributors. All rights reserved.
