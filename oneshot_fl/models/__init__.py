from oneshot_fl.models.registry import ARCHITECTURES, build, check_arch, expected_state

__all__ = ["ARCHITECTURES", "build", "check_arch", "expected_state"]
