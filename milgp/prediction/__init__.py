"""From the instance posterior to bag decisions: bag rules, bag-level calibration, averaging, and
instance probabilities calibrated to the MIL fits' posterior instance labels."""
from milgp.prediction import bag_decision, bag_rules, calibration, model_average
from milgp.prediction.bag_decision import AUTO_BAG_RULES, BagDecision, auto_bag_rules, best_decision, fit_bag_decision, score_bag_rules
from milgp.prediction.bag_posterior import BagPosterior, JointBlocks
from milgp.prediction.bag_rules import (
    BAG_RULES,
    DEFAULT_BAG_RULE,
    BagRule,
    JointMaxRule,
    JointNoisyOrRule,
    MarginalBagRule,
    MaxRule,
    NoisyOrRule,
    OrthantRule,
    TopKMeanRule,
    make_bag_rule,
)
from milgp.prediction.calibration import BagCalibrator, cross_fitted_calibration, stratified_folds
from milgp.prediction.instance_calibration import InstanceCalibrator
from milgp.prediction.model_average import AveragedFit, ModelAverage, pseudo_bma_plus_weights

__all__ = [
    *bag_decision.__all__,
    *model_average.__all__,
    *calibration.__all__,
    "InstanceCalibrator",
    "BagPosterior",
    "JointBlocks",
    *bag_rules.__all__,
]
