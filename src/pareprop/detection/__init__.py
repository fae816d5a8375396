"""Detection: torchvision's detectors on pareprop's backbones, and their COCO evaluation
(``coco_eval``) and pictures of predictions (``visualize``)."""
