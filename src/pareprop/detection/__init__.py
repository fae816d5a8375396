"""Detection: torchvision's Mask R-CNN, Faster R-CNN and RetinaNet on reversible backbones
(docs/detection.md).

* ``names``: ``ARCH:BACKBONE`` names and the registry of backbone builders by prefix;
* ``pyramid``: the FPN and ViTDet's simple feature pyramid, to maps ``p2``..``p6``;
* ``backbones``: a reversible trunk's features through its pyramid;
* ``heads``: anchors, RoI pooling and torchvision's heads (its defaults or ViTDet's);
* ``factory``: :func:`create_detector` and :func:`detector_from_spec`;
* ``coco_eval`` (COCO AP) and ``visualize`` (pictures of predictions), imported by name;
* ``detectron2``: detectron2's MViTv2 and ViTDet backbones, made reversible, with its weights.
"""

from pareprop.detection.backbones import PyramidBackbone, build_backbone
from pareprop.detection.factory import SMALL_DETECTOR, create_detector, detector_from_spec
from pareprop.detection.heads import HEADS
from pareprop.detection.light import is_memory_light, set_memory_light
from pareprop.detection.names import (
    DETECTOR_ARCHS,
    parse_detector_name,
    register_backbone,
)
from pareprop.detection.pyramid import FPN, LEVELS, SimpleFeaturePyramid

from pareprop.detection.detectron2 import from_detectron2  # noqa: E402,F401  registers detectron2:NAME  isort: skip
from pareprop.detection.names import backbone_builder  # noqa: E402  isort: skip
from pareprop.memory.detection import (  # noqa: E402  isort: skip
    DetectorFactory,
    register_detector_factory,
)

# NOTE [ Detectors reach the planner by registration ] (pareprop/memory/detection.py)
register_detector_factory(DetectorFactory(
    DETECTOR_ARCHS, create_detector, parse_detector_name, backbone_builder))

__all__ = [
    "DETECTOR_ARCHS",
    "HEADS",
    "LEVELS",
    "FPN",
    "PyramidBackbone",
    "SMALL_DETECTOR",
    "SimpleFeaturePyramid",
    "build_backbone",
    "create_detector",
    "detector_from_spec",
    "parse_detector_name",
    "is_memory_light",
    "register_backbone",
    "set_memory_light",
]
